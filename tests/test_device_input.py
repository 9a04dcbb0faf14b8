"""Device flags that silently meant something else (issue 12, item 8).

- ``--vram 24576``: nvidia-smi prints MiB, so a bare number below 1 MiB is almost surely
  MiB, not a 24 KiB card: an error that suggests ``24576MiB`` (bytes stay possible with an
  explicit ``B``).
- ``--gpu "4060 Ti"``: two cards answer to it (8 GB and 16 GB); an error lists both. The
  8 GB cards users run are in the catalogue: 4060 Ti 8GB, 3060 Ti, 3070, 4060.
"""

import pytest

from moefit.devices import GPU_CATALOGUE, find_gpu, resolve_device
from moefit.errors import InputError




MIB = 1 << 20


@pytest.mark.parametrize("flags", [
    dict(vram="24576"),                                  # a what-if card
    dict(device="cpu", vram="8192"),                     # a simulated device
    dict(vram="24GiB", vram_free="20000"),               # the free memory too
])
def test_bare_number_below_one_mib_suggests_mib(flags):
    args = dict(device=None, gpu=None, vram=None, vram_free=None) | flags
    bare = flags.get("vram_free") or flags["vram"]
    with pytest.raises(InputError, match=f"{bare}MiB"):
        resolve_device(**args)


def test_bytes_stay_possible_with_a_b_suffix_or_a_large_number():
    assert resolve_device(None, None, "24576B", None).capacity_bytes == 24576
    assert resolve_device(None, None, str(24 << 30), None).capacity_bytes == 24 << 30
    assert resolve_device(None, None, str(MIB), None).capacity_bytes == MIB


def test_bare_vram_through_the_cli_is_exit_2(capsys):
    from moefit.cli import main

    assert main(["plan", "Qwen3-30B-A3B", "--vram", "24576"]) == 2
    err = capsys.readouterr().err
    assert "--vram" in err and "24576MiB" in err


@pytest.mark.parametrize("name,candidates", [
    ("4060 Ti", {"RTX 4060 Ti 8GB", "RTX 4060 Ti 16GB"}),
    ("rtx 4060ti", {"RTX 4060 Ti 8GB", "RTX 4060 Ti 16GB"}),
])
def test_ambiguous_gpu_name_lists_the_candidates(name, candidates):
    with pytest.raises(InputError, match="ambiguous") as e:
        find_gpu(name)
    assert all(c in str(e.value) for c in candidates)


@pytest.mark.parametrize("name,total_mib", [
    ("4060 Ti 8GB", 8188), ("RTX 4060 Ti 16GB", 16380),
    ("3060 Ti", 8192), ("RTX 3070", 8192), ("4060", 8188),
    ("3060", 12288),            # the 12 GB RTX 3060 keeps its short name
])
def test_eight_gb_cards_are_in_the_catalogue(name, total_mib):
    card = find_gpu(name)
    assert card.capacity_bytes == total_mib * MIB
    assert 0 < card.free_bytes < card.capacity_bytes


def test_every_catalogue_card_cites_a_source():
    for spec in GPU_CATALOGUE:
        assert spec.source and spec.capacity_mib > spec.free_mib > 0, spec.name
    eight = [s for s in GPU_CATALOGUE if s.nominal_gb == 8]
    assert {s.name for s in eight} == {"RTX 4060 Ti 8GB", "RTX 3060 Ti", "RTX 3070", "RTX 4060"}
