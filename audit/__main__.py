from splitaudit.cli import main

main()
