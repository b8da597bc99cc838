"""Write mbtune/schemas/profile-v<N>.schema.json and history-v<N>.schema.json from the records (mbtune/saving/profile_schema.py).

Run from the checkout after changing a record: `python docs/generate_profile_schema.py`.
tests/unit/test_profile_schema.py fails when the shipped file differs from what the records give.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from mbtune.qualifying.history import history_file_name, history_schema
    from mbtune.saving.profile_schema import schema_file_name, schema_text
    from mbtune.saving.profiles import SCHEMA_VERSION

    for name, text in ((schema_file_name(SCHEMA_VERSION), schema_text()),
                       (history_file_name(), schema_text(history_schema()))):
        path = ROOT / "mbtune" / "schemas" / name
        path.write_text(text)
        sys.stdout.write(f"wrote {path.relative_to(ROOT)}\n")


if __name__ == "__main__":
    main()
