"""``python -m betty_trainer`` is ``betty-train`` (what ``torchrun -m betty_trainer train ...`` starts per process)."""

import sys

from betty_trainer.cli import main

sys.exit(main())
