"""One module per scenario: each function runs its scenario and stores its figures in
``results`` under its own key (the report's names for them)."""
