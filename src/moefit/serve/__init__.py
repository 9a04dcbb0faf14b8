"""``moefit serve`` and ``moefit generate``: text in, text out, around the runtime engine.

One job per file:

- :mod:`moefit.serve.text`: the checkpoint's tokenizer (``tokenizer.json``), its chat
  template (``tokenizer_config.json``), the sampling defaults and EOS ids
  (``generation_config.json``), and incremental detokenization with stop strings.
- :mod:`moefit.serve.generation`: one completion on the engine, token by token
  (sampling, EOS, stop strings, max tokens, the end of the context).
- :mod:`moefit.serve.protocol`: the OpenAI-compatible request bodies, validated.
- :mod:`moefit.serve.app`: the FastAPI application (``/health``, ``/v1/models``,
  ``/v1/completions``, ``/v1/chat/completions``, ``/v1/budget``), over
  :mod:`~moefit.serve.state`, :mod:`~moefit.serve.guard` (key, body limits, Host checks, error shape),
  :mod:`~moefit.serve.bodies` (parsing and tokenizing off the event loop),
  :mod:`~moefit.serve.runs` (a request's jobs and their events),
  :mod:`~moefit.serve.responses` (streams, logprobs) and :mod:`~moefit.serve.budget`.
- :mod:`moefit.serve.launch`: the two commands: plan, print, commit, READY, serve.

Needs the ``serve`` extra (``pip install 'moefit[serve]'``); ``moefit plan`` never
imports this package.
"""
