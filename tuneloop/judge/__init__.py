"""Judging a candidate: suites, scoring, statistics, the gate, fixed badcases, cards."""
