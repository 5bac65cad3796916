"""Print the README's two commands (the ```bash blocks of its "Two commands" section), one per
line, exactly as the README prints them: CI runs these, so the README cannot drift from CI."""

import re
import sys
from pathlib import Path


def readme_commands(readme: str) -> list[str]:
    section = re.search(r"^## Two commands\n(.*?)(?=^## )", readme, re.S | re.M)
    if section is None:
        raise SystemExit("README.md has no '## Two commands' section")
    blocks = [b.strip() for b in re.findall(r"```bash\n(.*?)```", section.group(1), re.S)]
    if len(blocks) != 2 or any("\n" in b for b in blocks):
        raise SystemExit(f"expected two one-line bash blocks under '## Two commands', found {blocks!r}")
    return blocks


if __name__ == "__main__":
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "README.md")
    print("\n".join(readme_commands(path.read_text())))
