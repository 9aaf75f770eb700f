"""``python -m betty_trainer`` is ``betty-train`` (what ``torchrun -m betty_trainer train ...`` starts per process).

Under a launcher that started several processes (``WORLD_SIZE`` above 1) a process ends with ``os._exit`` once the
command has returned and its output is flushed, skipping the interpreter's finalisation: gloo's worker threads can
still hold tensors there, and releasing them while the interpreter is torn down aborts the process
("terminate called without an active exception", SIGABRT; pytorch/pytorch#179291). Every file a run writes is
closed by then (checkpoints are written atomically) and the process group was left (``distributed.group.leave``).
"""

import logging
import os
import sys

from betty_trainer.cli import main

status = main()
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
sys.exit(status)
