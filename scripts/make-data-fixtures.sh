#!/usr/bin/env bash
# Writes the small data files the tests read that only another library writes: a Parquet file
# with page checksums, written by pyarrow (the parquet crate writes none). A person runs this;
# tests and CI only read what it wrote (tests/fixtures/data/).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${IVME_DATA_VENV:-/tmp/ivme-data-venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q pyarrow
"$venv/bin/python" - <<'PY'
import pyarrow as pa
import pyarrow.parquet as pq

# 400 rows in two row groups of 200: `id` = 1_000_000 + row (int64), `text` = "row {row}".
# Uncompressed and plainly encoded, so that a flipped byte inside a data page still decodes:
# only the page's CRC-32 can tell.
rows = 400
table = pa.table({
    "id": pa.array([1_000_000 + i for i in range(rows)], pa.int64()),
    "text": pa.array([f"row {i}" for i in range(rows)], pa.string()),
})
pq.write_table(
    table,
    "tests/fixtures/data/checksummed.parquet",
    row_group_size=200,
    compression="none",
    use_dictionary=False,
    write_page_checksum=True,
    write_statistics=False,
)
meta = pq.ParquetFile("tests/fixtures/data/checksummed.parquet").metadata
print(f"pyarrow {pa.__version__}: {meta.num_rows} rows, {meta.num_row_groups} row groups")
PY
