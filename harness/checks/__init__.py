"""The check registry: every check of a cell, declared once with its settings section, the
capabilities it needs and where its code lives (catalog, light to import), the cell context checks
read (context), and the driver that runs them (driver)."""
