"""Release sign-off: a candidate build's runs against the last signed-off build's (`harness signoff`)."""
