"""`specserve serve` with a fault injected into its engine loop: every loop pass is slowed by
0.03 s (streams stay in flight long enough to be caught), and once the file named by
SPECSERVE_TEST_LOOP_FAULT exists the loop raises outside any engine step, the way a bug in the
loop itself would end it. test_engine_death runs it in place of `python -m specserve`."""

import os
import sys
import time

from specserve.cli import main
from specserve.server.engine_loop import EngineLoop

TRIGGER = os.environ["SPECSERVE_TEST_LOOP_FAULT"]
_publish = EngineLoop._publish


def faulty_publish(self) -> None:
    if os.path.exists(TRIGGER):
        raise RuntimeError("injected engine-loop fault")
    time.sleep(0.03)
    _publish(self)


if __name__ == "__main__":
    EngineLoop._publish = faulty_publish
    sys.exit(main())
