"""kvfleet's contracts between its parts: constants only, importable anywhere without torch or kopf."""
