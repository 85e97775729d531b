"""``python -m hf_flashinfer_mla.serve``: Transformers' own ``transformers serve`` with ``flashinfer_mla`` registered,
and a server that one bad request cannot take down.

``transformers serve`` accepts only ``eager``, ``sdpa``, ``flash_attention_2/3``, ``flex_attention`` or a Hub kernel
id, and runs in a process that never imports this package. This wrapper is the thinnest way in: it imports the
package (which registers the implementation and continuous batching's paged latent cache), lets Transformers' model
loader accept the name, and runs Transformers' own server with the same options. The loader is `ModelManager` up to
Transformers 5.24 and `ModelLoader` from 5.25, where each model loads in a process of its own, spawned: the loader
is pickled there, and unpickling `MLAModelLoader` imports this module, so the model's process registers
``flashinfer_mla`` and gets this module's changes too (importing it installs them, idempotently). They are:

* the command line: ``--attn-implementation`` defaults to ``flashinfer_mla`` (any other value is passed through
  unchanged); ``--max-model-len`` exists on every Transformers version; ``--api-key`` (or ``HF_FLASHINFER_MLA_API_KEY``)
  makes requests send a key; a device this machine lacks, a model path that does not exist and other bad values are
  one line and exit status 2, before anything loads, as are the server's packages missing (the install that brings
  them named);
* with ``--continuous-batching``, a model continuous batching cannot serve (see ``paged_cache.refuse_unservable``) fails
  when it is loaded (at server start for a model named on the command line), not at its first request;
* requests checked, answers capped at the context, and a continuous-batching worker that dies replaced
  (``serve_guards.py``, ``serve_recovery.py``): one bad request never takes the server down.

    python -m hf_flashinfer_mla.serve /path/to/DeepSeek-V2-Lite-Chat --continuous-batching --dtype bfloat16
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
import typing
from typing import Annotated

from transformers.utils.import_utils import is_serve_available

PROG = "python -m hf_flashinfer_mla.serve"
INSTALL_SERVE = 'pip install -e ".[serve]"'


def _serving_packages_missing() -> str:
    """Transformers' serving code imports its web packages unconditionally: without them it fails with an ImportError
    about one of its own names, naming neither the packages nor the install that brings them."""
    missing = [name for name in ("fastapi", "uvicorn", "pydantic", "openai") if importlib.util.find_spec(name) is None]
    return (f"the server needs {', '.join(missing) or 'the packages of transformers[serving]'}, not installed: "
            f"{INSTALL_SERVE} in this repository's checkout (without FlashInfer: pip install "
            '"transformers[serving]")')


if not is_serve_available():
    if __name__ == "__main__":
        print(f"{PROG}: error: {_serving_packages_missing()}", file=sys.stderr)
        sys.exit(2)
    raise ImportError(_serving_packages_missing())

from transformers.cli.serving import model_manager as _transformers_model_manager  # noqa: E402
from transformers.utils import logging  # noqa: E402

from . import paged_cache, serve_guards, serve_recovery  # noqa: E402
from .models import ATTN_NAME  # noqa: E402

logger = logging.get_logger("hf_flashinfer_mla")


# --------------------------------------------------------------------------------------------------------------
# The model loader
# --------------------------------------------------------------------------------------------------------------
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
            paged_cache.refuse_unservable(model)
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


def loader_problem() -> str | None:
    """Why this Transformers' model loader is not one `_AcceptsFlashinferMLA` fits (None where it is): it takes
    ``continuous_batching`` and has `_validate_args` and `_load_model`, as 5.24's `ModelManager` and 5.25's
    `ModelLoader` do (older releases' `ModelManager` takes no ``continuous_batching``)."""
    loader = _ModelLoader or getattr(_transformers_model_manager, "ModelManager", None)
    if loader is None:
        return "cli.serving.model_manager has no ModelLoader or ModelManager"
    missing = [f"{name}()" for name in ("_validate_args", "_load_model") if not callable(getattr(loader, name, None))]
    if "continuous_batching" not in inspect.signature(loader.__init__).parameters:
        missing.append("continuous_batching=")
    return f"cli.serving.model_manager.{loader.__name__} takes no {', '.join(missing)}" if missing else None


def _record_loader_problem() -> None:
    """Record `loader_problem` where the package keeps what it cannot do on this Transformers."""
    from . import registration

    why = loader_problem()
    if why is not None:
        registration.UNAVAILABLE.setdefault(registration.SERVE, why)


_record_loader_problem()


def install() -> None:
    """What this package changes in Transformers' server (``serve_guards.py``, ``serve_recovery.py``; idempotent):
    run on import, so that every process of the server has it (the model's process and the API servers import this
    module when they unpickle the loader)."""
    serve_guards.install()
    serve_recovery.install()


if __name__ not in ("__main__", "__mp_main__"):  # run as a script, the importable module installs them (main())
    install()


# --------------------------------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------------------------------
def _fail(message: str, status: int = 2) -> typing.NoReturn:
    """One line on stderr and exit status 2, as argparse does for a bad argument (without the usage block)."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(status)


_ATTN_IMPLEMENTATIONS = (ATTN_NAME, "eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


def _check_model_type(model: str, attn: str) -> None:
    """Exit 2 with one line where a local checkpoint is not a model ``flashinfer_mla`` runs (the model's process
    would fail with two tracebacks). A Hub id is checked when it loads, where its config is."""
    from transformers import AutoConfig

    if attn != ATTN_NAME or not os.path.isfile(os.path.join(os.path.expanduser(model), "config.json")):
        return
    try:
        config = AutoConfig.from_pretrained(os.path.expanduser(model))
    except Exception:  # noqa: BLE001  (a config Transformers cannot read: its own loading reports it)
        return
    why = serve_guards.unservable(config, attn)
    if why is not None:
        _fail(f"FORCE_MODEL {model}: {why}; serve it with --attn-implementation sdpa (or eager)")


def _check_command_line(options: dict) -> None:
    """Exit 2 with one line for what would otherwise fail with a traceback once the server starts loading."""
    import torch

    from . import registration
    from .__main__ import device_problem
    from .errors import TransformersVersionError

    try:  # (a Transformers whose server or continuous batching this package does not fit: before anything loads)
        registration.require(registration.SERVE)
        if options.get("continuous_batching"):
            registration.require(registration.CONTINUOUS_BATCHING, instead="serve without --continuous-batching")
    except TransformersVersionError as error:
        _fail(str(error))
    device = options["device"]
    if device != "auto" and not device.isdigit():
        problem = device_problem(device)
        if problem is not None:
            _fail(f"--device {problem}")
    elif device.isdigit() and not torch.cuda.is_available():
        _fail(f"--device {device} is a CUDA device index, but torch sees no CUDA GPU; use --device cpu")
    model = options.get("force_model")
    if model:
        repo = model[: model.rindex(":")] if model.endswith(".gguf") and ":" in model else model
        local = serve_guards.looks_local(repo)
        expanded = os.path.expanduser(repo)
        if os.path.isdir(expanded):
            if repo == model and not os.path.isfile(os.path.join(expanded, "config.json")):
                _fail(f"FORCE_MODEL {model}: the directory has no config.json; give a checkpoint directory "
                      "(config.json, weights and tokenizer files) or a Hub model id (org/name)")
        elif os.path.exists(expanded):
            _fail(f"FORCE_MODEL {model}: not a directory; give a checkpoint directory or a Hub model id (org/name)")
        elif local:
            _fail(f"FORCE_MODEL {model}: no such directory; give a checkpoint directory or a Hub model id (org/name)")
    dtype = options.get("dtype")
    if dtype not in (None, "auto") and not isinstance(getattr(torch, dtype, None), torch.dtype):
        _fail(f"--dtype {dtype}: not a torch dtype; use auto, bfloat16, float16 or float32")
    quantization = options.get("quantization")
    if quantization not in (None, "bnb-4bit", "bnb-8bit"):
        _fail(f"--quantization {quantization}: use bnb-4bit or bnb-8bit")
    attn = options.get("attn_implementation")
    if attn not in _ATTN_IMPLEMENTATIONS and "/" not in attn:
        _fail(f"--attn-implementation {attn}: use {', '.join(_ATTN_IMPLEMENTATIONS)} or a Hub kernel id (org/name)")
    max_model_len = options.get("max_model_len")
    if max_model_len is not None and max_model_len < 1:
        _fail(f"--max-model-len {max_model_len}: give the longest a request may be, prompt and answer, in tokens "
              "(at least 1), or leave it out for the model's context length")
    count = options.get("api_server_count", 1)
    if count < 1 or (count > 1 and not model):
        _fail(f"--api-server-count {count}: give at least 1, and a model on the command line (FORCE_MODEL) for more")
    if model:
        _check_model_type(model, attn)
    if options.get("api_key") == "":
        _fail("--api-key is empty: give the key clients must send (Authorization: Bearer <key>), or leave it out")


_LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
HELP = f"""Serve MLA models (DeepSeek-V2/V3/V3.2, Kimi-K2, GLM, ...) through an OpenAI-compatible API, with
{ATTN_NAME} attention: Transformers' own server (transformers serve) with this package registered.

\b
Endpoints:
    POST /v1/chat/completions   chat completions, streamed or not
    POST /v1/completions        text completions from a prompt
    POST /v1/responses          the Responses API
    GET  /v1/models             the models it serves
    GET  /health                health check

\b
FORCE_MODEL (a checkpoint directory or a Hub id) is loaded at start; without it each request's "model" is loaded
at its first request. --continuous-batching serves concurrent requests from one paged latent cache. Requests are
checked: a field the server cannot honour gets a 400 naming it.

\b
--api-key (or the environment variable {serve_guards.API_KEY_ENV}, which keeps the key out of the process list):
requests must send "Authorization: Bearer <key>" (else a 401); /health stays open.

\b
Install the server's packages with the package: {INSTALL_SERVE} (in this repository's checkout).
"""


def _option_help(annotation) -> str | None:
    """The help text of a typer ``Annotated[type, typer.Option/Argument(help=...)]``."""
    return next((getattr(meta, "help", None) for meta in typing.get_args(annotation)[1:]), None)


def _command():
    """Transformers' ``serve`` command as a command of its own (its usage line is what one types), with this
    package's defaults: Transformers' options, read off `Serve`'s signature, so every version's are there."""
    import typer
    from transformers.cli.serve import Serve

    parameters = [p for name, p in inspect.signature(Serve.__init__, eval_str=True).parameters.items()
                  if name != "self"]
    names = [p.name for p in parameters]
    changed = []
    for parameter in parameters:
        if parameter.name == "force_model":
            parameter = parameter.replace(annotation=Annotated[str | None, typer.Argument(
                metavar="FORCE_MODEL", show_default=False, help=_option_help(parameter.annotation))])
        elif parameter.name == "attn_implementation":
            parameter = parameter.replace(default=ATTN_NAME, annotation=Annotated[str, typer.Option(help=(
                f"Attention implementation: {ATTN_NAME} (this package's, for MLA models), or eager, sdpa, "
                "flash_attention_2/3, flex_attention or a Hub kernel id, passed to Transformers."))])
        changed.append(parameter)
        if parameter.name == "port":
            changed.append(inspect.Parameter(
                "api_key", inspect.Parameter.KEYWORD_ONLY, default=None,
                annotation=Annotated[str | None, typer.Option(show_default=False, help=(
                    "The key every request must send as 'Authorization: Bearer <key>' (a 401 otherwise; /health "
                    f"stays open). Also read from ${serve_guards.API_KEY_ENV}, which keeps it out of the process "
                    "list."))]))
        if parameter.name == "model_timeout" and "max_model_len" not in names:  # (Transformers <= 5.24)
            changed.append(inspect.Parameter(
                "max_model_len", inspect.Parameter.KEYWORD_ONLY, default=None,
                annotation=Annotated[int | None, typer.Option(help=(
                    "The longest a request can be, prompt and answer, in tokens. Defaults to the model's context "
                    "length."))]))
    changed = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in changed]

    def serve(**options):
        _check_command_line(options)
        key = options.pop("api_key")
        if key is not None:  # (the environment reaches every process of the server: its API servers check it)
            os.environ[serve_guards.API_KEY_ENV] = key
        if not os.environ.get(serve_guards.API_KEY_ENV) and options.get("host") not in _LOCAL_HOSTS:
            print(f"{PROG}: warning: --host {options.get('host')} without an API key: anyone who reaches port "
                  f"{options.get('port')} can use the server (and /reset its models); set {serve_guards.API_KEY_ENV} "
                  "or --api-key", file=sys.stderr)
        if not options.get("force_model"):
            print(f"{PROG}: no model given: each request names its model (a checkpoint directory or a Hub id), "
                  "loaded at its first request", file=sys.stderr)
        if "max_model_len" not in names:  # (answers are capped by serve_guards, which reads it)
            serve_guards.MAX_MODEL_LEN = options.pop("max_model_len")
        Serve(**options)

    serve.__signature__ = inspect.Signature(changed)
    serve.__annotations__ = {p.name: p.annotation for p in changed}
    serve.__doc__ = HELP
    app = typer.Typer(add_completion=False, rich_markup_mode=None)
    app.command(context_settings={"max_content_width": 120, "help_option_names": ["-h", "--help"]})(serve)
    return typer.main.get_command(app)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    # `Serve` imports its loader from this module when it starts: it gets the subclass.
    if _ModelLoader is not None:
        _transformers_model_manager.ModelLoader = MLAModelLoader
    elif not issubclass(_transformers_model_manager.ModelManager, _AcceptsFlashinferMLA):
        _transformers_model_manager.ModelManager = _model_manager_class()
    try:
        status = _command().main(args=argv, prog_name=PROG, standalone_mode=False)
    except Exception as error:
        # click's usage errors (typer's own copy of click raises its own classes): one line, as argparse's
        if hasattr(error, "format_message") and hasattr(error, "exit_code"):
            _fail(f"{error.format_message()} (see {PROG} --help)", error.exit_code)
        raise
    if isinstance(status, int) and status:
        sys.exit(status)


if __name__ == "__main__":
    # The importable module's `main`, not this copy's: the model's process unpickles the loader by its module's name,
    # and the changes above belong to one module.
    from hf_flashinfer_mla.serve import main as _main

    _main()
