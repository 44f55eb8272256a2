"""Print the README's two Quickstart commands, one per line, in order (for .ci/run to run them
exactly as a new user would)."""

import pathlib
import re

readme = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
section = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
commands = [line for block in re.findall(r"```bash\n(.*?)```", section, re.S)
            for line in block.splitlines() if line.strip() and not line.startswith("#")]
assert len(commands) == 2, commands
print("\n".join(commands))
