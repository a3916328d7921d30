"""Report configs: one get_config() per script in experiments/ that reads results (tables, figures)."""
