from gpt_lightning.cli import main

main()
