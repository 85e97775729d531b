"""The exceptions this package raises. Each message names what to do instead."""


class FlashInferMLAError(ValueError):
    """Base class: a request this package cannot serve correctly."""


class UnsupportedModelError(FlashInferMLAError):
    """The model has no MLA attention this package can run."""


class BackendUnavailableError(FlashInferMLAError):
    """A backend was forced that cannot run on this device, dtype or shape."""


class CacheLayoutError(FlashInferMLAError):
    """The cache handed the attention something other than the MLA latent."""
