"""The entry gunicorn loads: settings from the environment, then the app.

No monkey-patching here: gunicorn's gevent worker patches before it imports this.
"""

import logging

from picomq import create_app
from settings import Settings

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
app = create_app(Settings.from_environment())
