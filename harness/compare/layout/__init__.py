"""Layout checks: each rank's actual heads, shards, caches, placements and experts against the plan."""
