/* What the loader checks before it uses the library (moefit.runtime.kernels.native): the ABI
 * version of moefit_kernels.h, the layout of every structure, and the sources it was built from.
 *
 * mf_abi_fields lists each structure's sizeof and each field's offsetof / sizeof by name; the
 * loader compares them, field by field, with the ctypes mirror (kernels/lean_abi.py) and
 * refuses a library whose layout differs. A field added to a structure and not here changes
 * its sizeof; one added here and not in the mirror is reported as missing there. */
#include <stddef.h>
#include "moefit_kernels.h"

#ifndef MF_SOURCES
#define MF_SOURCES ""            /* the builder passes -DMF_SOURCES="<hash of the sources>" */
#endif

#define S_(T) {#T, "", 0, sizeof(T)}
#define F_(T, f) {#T, #f, offsetof(T, f), sizeof(((T *)0)->f)}

static const mf_abi_field FIELDS[] = {
    S_(mf_mat), F_(mf_mat, p), F_(mf_mat, type), F_(mf_mat, rows), F_(mf_mat, cols), F_(mf_mat, pad),

    S_(mf_lean_layer),
    F_(mf_lean_layer, in_norm), F_(mf_lean_layer, post_norm),
    F_(mf_lean_layer, q), F_(mf_lean_layer, k), F_(mf_lean_layer, v), F_(mf_lean_layer, o),
    F_(mf_lean_layer, router),
    F_(mf_lean_layer, qb), F_(mf_lean_layer, kb), F_(mf_lean_layer, vb), F_(mf_lean_layer, ob),
    F_(mf_lean_layer, qn), F_(mf_lean_layer, kn), F_(mf_lean_layer, kc), F_(mf_lean_layer, vc),
    F_(mf_lean_layer, heads), F_(mf_lean_layer, kvh), F_(mf_lean_layer, d), F_(mf_lean_layer, dv),
    F_(mf_lean_layer, cells), F_(mf_lean_layer, window), F_(mf_lean_layer, kcode), F_(mf_lean_layer, vcode),
    F_(mf_lean_layer, knb), F_(mf_lean_layer, vnb), F_(mf_lean_layer, scale),
    F_(mf_lean_layer, e), F_(mf_lean_layer, topk), F_(mf_lean_layer, inter),
    F_(mf_lean_layer, gt), F_(mf_lean_layer, ut), F_(mf_lean_layer, dt),
    F_(mf_lean_layer, up_off), F_(mf_lean_layer, down_off), F_(mf_lean_layer, pchunk),
    F_(mf_lean_layer, table), F_(mf_lean_layer, mask), F_(mf_lean_layer, hits), F_(mf_lean_layer, misses),
    F_(mf_lean_layer, cells_of), F_(mf_lean_layer, ctx),

    S_(mf_lean_step),
    F_(mf_lean_step, t), F_(mf_lean_step, h), F_(mf_lean_step, ad), F_(mf_lean_step, threads),
    F_(mf_lean_step, qk_norm), F_(mf_lean_step, renorm), F_(mf_lean_step, rot), F_(mf_lean_step, pdt),
    F_(mf_lean_step, eps), F_(mf_lean_step, off), F_(mf_lean_step, clip),
    F_(mf_lean_step, hidden), F_(mf_lean_step, normed), F_(mf_lean_step, delta), F_(mf_lean_step, acc),
    F_(mf_lean_step, gscratch), F_(mf_lean_step, q), F_(mf_lean_step, k), F_(mf_lean_step, v),
    F_(mf_lean_step, o), F_(mf_lean_step, pos), F_(mf_lean_step, slot), F_(mf_lean_step, cs),
    F_(mf_lean_step, sn), F_(mf_lean_step, rlog), F_(mf_lean_step, bptr), F_(mf_lean_step, bounds),
    F_(mf_lean_step, tok), F_(mf_lean_step, wsel), F_(mf_lean_step, stats), F_(mf_lean_step, mscratch),
    F_(mf_lean_step, pending),
};

int mf_abi_version(void) { return MF_ABI_VERSION; }

const mf_abi_field *mf_abi_fields(int *n) {
    *n = (int)(sizeof FIELDS / sizeof FIELDS[0]);
    return FIELDS;
}

const char *mf_sources(void) { return MF_SOURCES; }
