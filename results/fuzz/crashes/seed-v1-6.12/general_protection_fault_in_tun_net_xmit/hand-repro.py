# Hand-written reproducer (2026-11-23; syz-repro found none in the 16 min the run left it).
# Run as root in a seed-v1-6.12 guest: lab/lab run seed-v1-6.12 'python3 results/fuzz/crashes/seed-v1-6.12/general_protection_fault_in_tun_net_xmit/hand-repro.py'
# v1 crashed at 'ip link set t0 up' (IPv6 DAD transmits through the zero-slot ring):
# KASAN: null-ptr-deref in range [0x10-0x17], RIP tun_net_xmit (__ptr_ring_full).
import fcntl, os, socket, struct, subprocess, time
TUNSETIFF = 0x400454ca
fd = os.open("/dev/net/tun", os.O_RDWR)
fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", b"t0", 0x0001 | 0x1000))  # IFF_TUN|IFF_NO_PI
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
SIOCSIFTXQLEN = 0x8943
fcntl.ioctl(s, SIOCSIFTXQLEN, struct.pack("16si", b"t0", 0))
print("txqueuelen 0 set", flush=True)
subprocess.run("ip addr add 10.9.0.1/24 dev t0; ip link set t0 up; ip -d link show t0", shell=True)
time.sleep(1)
print("sending", flush=True)
s.sendto(b"x", ("10.9.0.2", 9))
time.sleep(2)
print("survived", flush=True)
