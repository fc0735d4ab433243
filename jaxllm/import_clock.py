"""When this process first imported jaxllm: start-up logs measure from here.

A leaf module, so that the package root and the engine's start-up code both read
the clock without importing each other.
"""

import time

IMPORT_TIME = time.time()
