"""`python -m cloudtrain.tools.netem relay|relay-ceiling ...`: the delay line's processes, which
the emulator starts (cli.child_main reads their arguments). Users run `cloudtrain netem`."""

import sys

from .cli import child_main

sys.exit(child_main())
