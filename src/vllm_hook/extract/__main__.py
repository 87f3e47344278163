"""`python -m vllm_hook.extract ...` is `vllm-hook extract ...`."""

import sys

from .cli import main

sys.exit(main())
