"""The entry gunicorn loads: settings from the environment, then the app.

No monkey-patching here: gunicorn's gevent worker patches before it imports this.
A bad PICOMQ_* value stops the boot with one line naming the variable.
"""

import gc
import logging

from picomq import create_app
from settings import Settings, SettingsError

YOUNG_COLLECTION_THRESHOLD = 10_000  # tracked objects allocated, net, between collections

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
try:
    settings = Settings.from_environment()
except SettingsError as error:
    raise SystemExit(f"picomq: invalid setting: {error}") from None
app = create_app(settings)
# A request in flight holds a score of objects the collector tracks (its request, its
# commit's plan and record, their results) until its commit is stored. With CPython's
# default threshold (700) a worker taking 64 appends over many streams ran a young
# collection every few appends, over objects that reference counting frees a moment
# later, and the older generations' in turn (figures: bench/README.md).
gc.set_threshold(YOUNG_COLLECTION_THRESHOLD)
# The app's own objects (modules, routes, settings) live as long as the worker: moved out
# of the collector's reach, they are not traversed again by every full collection, which
# batched JSON appends trigger often (figures: bench/README.md).
gc.freeze()
