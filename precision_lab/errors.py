"""The lab's one error type for bad input: the CLI prints its message on one line and exits 2."""


class LabInputError(ValueError):
    """Bad input (file, key, value): the message names the file, the key and what was expected."""


class ModelSpecError(LabInputError):
    """A model spec that cannot describe a network: the message names the layer and the fix."""
