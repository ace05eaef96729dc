"""`moeswap bench ...`: measurements that write JSON + markdown, never timed tests."""
