"""Print the first ```python block of the README's "Quick start" section (for check_wheel.sh)."""

import re
import sys
from pathlib import Path

text = Path(sys.argv[1]).read_text()
section = text.split("## Quick start", 1)[1]
match = re.search(r"```python\n(.*?)```", section, re.S)
if match is None:
    sys.exit("README has no python block under '## Quick start'")
print(match.group(1))
