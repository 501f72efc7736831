from fusectl.cli import main

main()
