"""The 'folio' logger: INFO to stderr unless the application configured logging."""

import logging


def configure_logging(level: int = logging.INFO) -> None:
    logger = logging.getLogger("folio")
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s",
                                           "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(level)
