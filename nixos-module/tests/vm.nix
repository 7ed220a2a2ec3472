# NixOS VM test: boots hosts/cpu's kiln instance (the CPU package, the default-model package), waits
# for READY=1, calls the API, and checks the unit's directives as systemd applied them, that it starts
# on boot, and that it comes back after a crash. Runs on a Nix host: `nix build .#checks.x86_64-linux.vm`.
{ pkgs, kiln }:
pkgs.testers.runNixOSTest {
  name = "kiln-service";
  node.specialArgs = { inherit kiln; };
  nodes.machine = {
    imports = [
      kiln.nixosModules.default
      ../../hosts/cpu/kiln.nix
    ];
    virtualisation.memorySize = 2048;
    virtualisation.cores = 2;
    environment.systemPackages = [ pkgs.curl ];
  };
  testScript = ''
    import json

    machine.wait_for_unit("kiln-default.service")
    machine.wait_for_open_port(8000)
    machine.succeed("curl -sf http://127.0.0.1:8000/ready")

    body = json.dumps({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
    out = json.loads(machine.succeed(
        f"curl -sf http://127.0.0.1:8000/v1/completions -H 'content-type: application/json' -d '{body}'"
    ))
    assert out["usage"]["completion_tokens"] == 8, out
    assert out["choices"][0]["text"], out
    metrics = machine.succeed("curl -sf http://127.0.0.1:8000/metrics")
    assert "kiln_requests_total" in metrics, metrics[:500]

    props = dict(
        line.split("=", 1)
        for line in machine.succeed(
            "systemctl show kiln-default.service -p Type -p LimitMEMLOCK -p Restart -p TimeoutStartUSec"
            " -p WatchdogUSec -p DynamicUser -p ProtectSystem -p PrivateDevices -p DevicePolicy"
            " -p MemoryDenyWriteExecute -p StateDirectory -p After -p WantedBy -p NoNewPrivileges"
        ).splitlines()
        if "=" in line
    )
    expected = {
        "Type": "notify",
        "LimitMEMLOCK": "infinity",
        "Restart": "on-failure",
        "TimeoutStartUSec": "15min",
        "WatchdogUSec": "1min",
        "DynamicUser": "yes",
        "ProtectSystem": "strict",
        "PrivateDevices": "yes",
        "DevicePolicy": "closed",
        "MemoryDenyWriteExecute": "yes",
        "NoNewPrivileges": "yes",
        "StateDirectory": "kiln/default",
    }
    for key, value in expected.items():
        assert props.get(key) == value, f"{key}={props.get(key)!r}, expected {value!r}"
    assert "network-online.target" in props["After"], props["After"]
    assert "multi-user.target" in props["WantedBy"], props["WantedBy"]
    machine.succeed("systemctl is-enabled kiln-default.service")

    # Restart on failure: a SIGKILLed server comes back and serves again.
    machine.succeed("systemctl kill --signal=SIGKILL kiln-default.service")
    machine.wait_until_succeeds(
        "test $(systemctl show -p NRestarts --value kiln-default.service) -ge 1", timeout=120
    )
    machine.wait_until_succeeds("curl -sf http://127.0.0.1:8000/ready", timeout=300)

    # SIGTERM: a clean stop (drain, exit 0), so systemd records success, not a failure.
    machine.succeed("systemctl stop kiln-default.service")
    result = machine.succeed("systemctl show -p Result --value kiln-default.service").strip()
    assert result == "success", result
  '';
}
