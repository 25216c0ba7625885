"""python -m spin_trtllm.cli"""

from . import console

console()
