from app.launcher import entry

entry()
