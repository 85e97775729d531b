"""``python -m hf_flashinfer_mla.serve``: Transformers' own ``transformers serve`` with ``flashinfer_mla`` registered.

``transformers serve`` accepts only ``eager``, ``sdpa``, ``flash_attention_2/3``, ``flex_attention`` or a Hub kernel
id, and runs in a process that never imports this package. This wrapper is the thinnest way in: it imports the
package (which registers the implementation and continuous batching's paged latent cache), lets Transformers' model
loader accept the name, and starts Transformers' own CLI with the same options. The loader is `ModelManager` up to
Transformers 5.24 and `ModelLoader` from 5.25, where each model loads in a process of its own, spawned: the loader
is pickled there, and unpickling `MLAModelLoader` imports this module, so the model's process registers
``flashinfer_mla`` too. Three additions, all for MLA checkpoints:

* ``--attn-implementation`` defaults to ``flashinfer_mla`` (any other value is passed through unchanged);
* with ``--continuous-batching``, a model continuous batching cannot serve (see ``paged.refuse_unservable``) fails
  when it is loaded (at server start for a model named on the command line), not at its first request;
* a chat completion without a list of ``messages`` gets a 422 naming the field: Transformers 5.24's handler reads
  ``body["messages"]`` unchecked and answers a 500 (a KeyError).

    python -m hf_flashinfer_mla.serve /path/to/DeepSeek-V2-Lite-Chat --continuous-batching --dtype bfloat16
"""

from __future__ import annotations

import sys

from transformers.cli.serving import model_manager as _transformers_model_manager

from . import paged
from .models import ATTN_NAME


class _AcceptsFlashinferMLA:
    """What both loaders need: Transformers checks the name against a fixed set (everything else it checks is
    kept), and a model continuous batching cannot serve is refused as it loads."""

    def _validate_args(self):
        implementation = self.attn_implementation
        if implementation == ATTN_NAME:
            self.attn_implementation = None
        try:
            super()._validate_args()
        finally:
            self.attn_implementation = implementation

    def _load_model(self, *args, **kwargs):
        model = super()._load_model(*args, **kwargs)
        if self._flashinfer_mla_cb:
            paged.refuse_unservable(model)
        return model


# Transformers 5.25+: the loader is its own class, pickled to each model's process; up to 5.24 (None here)
# ModelManager loads the models itself.
_ModelLoader = getattr(_transformers_model_manager, "ModelLoader", None)

if _ModelLoader is not None:

    class MLAModelLoader(_AcceptsFlashinferMLA, _ModelLoader):
        """Transformers' `ModelLoader`, accepting ``flashinfer_mla`` and checking continuous batching at load (in
        the model's process: the refusal becomes the engine's fatal error, which stops the server at start)."""

        def __init__(self, *args, continuous_batching: bool = False, **kwargs):
            self._flashinfer_mla_cb = continuous_batching
            super().__init__(*args, continuous_batching=continuous_batching, **kwargs)


def _model_manager_class():
    """Transformers 5.24's `ModelManager`, accepting ``flashinfer_mla`` and checking continuous batching at load."""

    class MLAModelManager(_AcceptsFlashinferMLA, _transformers_model_manager.ModelManager):
        def __init__(self, *args, continuous_batching: bool = False, **kwargs):
            self._flashinfer_mla_cb = continuous_batching  # (set first: the forced model loads inside __init__)
            super().__init__(*args, continuous_batching=continuous_batching, **kwargs)

    return MLAModelManager


def _require_messages() -> None:
    """Chat completions without a non-empty ``messages`` list get a 422 (Transformers' own check covers unknown
    fields only; its handler then raises a KeyError, a 500)."""
    from fastapi import HTTPException
    from transformers.cli.serving.chat_completion import ChatCompletionHandler

    original = ChatCompletionHandler._validate_request
    if getattr(original, "_flashinfer_mla", False):
        return

    def validate(self, body: dict) -> None:
        original(self, body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise HTTPException(status_code=422, detail="`messages` must be a non-empty list of chat messages")

    validate._flashinfer_mla = True
    ChatCompletionHandler._validate_request = validate


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--attn-implementation" or a.startswith("--attn-implementation=") for a in argv):
        argv += ["--attn-implementation", ATTN_NAME]
    # `Serve` imports its loader from this module when it starts: it gets the subclass.
    if _ModelLoader is not None:
        # (the class of the importable module, not of ``__main__``: the model's process unpickles it by name)
        from hf_flashinfer_mla import serve

        _transformers_model_manager.ModelLoader = serve.MLAModelLoader
    else:
        _transformers_model_manager.ModelManager = _model_manager_class()
    _require_messages()
    from transformers.cli.transformers import app

    app(args=["serve", *argv], prog_name="python -m hf_flashinfer_mla.serve")


if __name__ == "__main__":
    main()
