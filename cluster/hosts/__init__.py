"""`cluster up --hosts FILE`: node services on other machines over ssh, and the coordinator here."""
