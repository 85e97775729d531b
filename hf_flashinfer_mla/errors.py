"""The exceptions this package raises. Each message names what to do instead."""


class FlashInferMLAError(ValueError):
    """Base class: a request this package cannot serve correctly."""


class UnsupportedModelError(FlashInferMLAError):
    """The model has no MLA attention this package can run."""


class BackendUnavailableError(FlashInferMLAError):
    """A backend was forced that cannot run on this device, dtype or shape."""


class CacheLayoutError(FlashInferMLAError):
    """The cache handed the attention something other than the MLA latent."""


class TransformersVersionError(FlashInferMLAError, ImportError):
    """The installed Transformers lacks what this package changes in it, or has it in another shape than the releases
    the package is tested with (`supported.TESTED`). Raised by ``import hf_flashinfer_mla`` where nothing can run,
    and where a feature is asked for (continuous batching, the server) where only that feature cannot. An
    ImportError too, so that code guarding the import catches it."""
