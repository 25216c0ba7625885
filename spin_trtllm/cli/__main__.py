"""python -m spin_trtllm.cli"""

import sys

from . import main

sys.exit(main())
