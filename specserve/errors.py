"""The error every boundary check raises for a checkpoint, config file or setting specserve cannot
use; its message says what was wrong and what to do."""


class ConfigError(ValueError):
    """A checkpoint or setting that specserve cannot use; the message says what to do."""
