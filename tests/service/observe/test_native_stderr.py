"""What native code writes to descriptor 2 in `labkit serve` (serve.observe.logsafe.capture_native_stderr) reaches
the real stderr escaped, line by line, up to the last line before the process ends without its teardown."""
import subprocess
import sys

SCRIPT = """
import os
from serve.observe.logsafe import capture_native_stderr
from serve.process_exit import end_without_teardown
capture_native_stderr()
os.write(2, b"".join(b"line %d \\x1b[2J\\r\\n" % i for i in range(3000)))
end_without_teardown(0)
"""


def test_the_last_native_lines_reach_stderr_escaped_before_the_process_ends():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, timeout=60)
    assert proc.returncode == 0
    lines = proc.stderr.decode().splitlines()
    assert len(lines) == 3000 and lines[-1] == "native: line 2999 \\x1b[2J\\r"
    assert b"\x1b" not in proc.stderr and b"\r" not in proc.stderr
