"""Multi-LoRA without torch: the request's adapter, reading and checking PEFT adapters, the names a
server serves. The engine side (host cache, device slots, the LoRA linear method) is worker/lora/."""
