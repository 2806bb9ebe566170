"""Test support shipped with fulmen: the OpInfo database (``fulmen.tests.opinfos``)."""
