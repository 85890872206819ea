from trainmaster.cli.main import main

main()
