"""``python -m autodeploy.coverage MODEL_TYPE --result FILE``: the child process of a sweep."""

import sys

from .check import main

sys.exit(main())
