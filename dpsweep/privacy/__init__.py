"""Privacy accounting without torch: the ledger of DpEvents, RDP, schedules, calibration, private statistics."""
