"""Imports the built-in cache modules so that they register their methods."""

from . import dense  # noqa: F401
from . import polar  # noqa: F401
from . import intq  # noqa: F401
from . import lowrank  # noqa: F401
from . import vq  # noqa: F401
from . import window_cache  # noqa: F401
from . import hybrid  # noqa: F401
