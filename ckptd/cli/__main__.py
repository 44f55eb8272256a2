"""``python -m ckptd.cli``: the ``ckptd`` command."""

import sys

from ckptd.cli import main

sys.exit(main())
