"""The qualification's wing: re-run a baseline or a spec here and judge it PASS, FAIL, INCONCLUSIVE or ERROR."""
