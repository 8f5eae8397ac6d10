"""The one error type of the data pipeline."""


class DataFileError(ValueError):
    """A data, index or tokenizer file is missing, malformed or does not fit the config.

    The message is meant for the user as-is: it names the file, the rule that failed and the fix.
    """
