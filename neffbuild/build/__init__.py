"""The CI side: compile every unit, publish bundles and releases, push them between stores."""
