"""`moeswap bench ...`: measurements that write JSON + markdown, never timed tests."""

RESULTS_DIR = "bench-results"  # where every bench writes its files unless --out-dir says otherwise
