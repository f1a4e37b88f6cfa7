"""The words cudaenv's results are said in: a check's status, a matrix cell's, a grid
column's, a whole run's verdict.

A leaf: the error classes (each exit code's cell status), the checks and the reports all
name these, so they live below every one of them. A report holding any other word is
refused on read.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

# What a check comes to.
CheckStatus = Literal["passed", "failed", "skipped"]
CHECK_STATUSES: tuple[CheckStatus, ...] = get_args(CheckStatus)
PASSED: Final = "passed"
FAILED: Final = "failed"
SKIPPED: Final = "skipped"

# A matrix cell's status ("refused" is a policy verdict on a combination, shown but not a
# failure of the matrix).
CellStatus = Literal["passed", "failed", "refused", "error", "not run"]
CELL_STATUSES: tuple[CellStatus, ...] = get_args(CellStatus)

# What a grid column shows: the cell's stage status, a check's status, or "-" for a check the
# spec does not run.
ColumnStatus = Literal[CellStatus, CheckStatus, "-"]
COLUMN_STATUSES: tuple[ColumnStatus, ...] = get_args(ColumnStatus)

# Whether a whole verify run or matrix passed.
Verdict = Literal["passed", "failed"]
