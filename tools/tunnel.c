// SPDX-License-Identifier: GPL-2.0
/*
 * tunnel - a minimal user-space "VPN": one tun device <-> one UDP socket.
 *
 * usage: tunnel --dev NAME [--flags HEX] --local IP:PORT --peer IP:PORT
 *               [--delay-us N] [--spin-us N] [--rate-pps N [--burst N]]
 *               [--sndbuf B] [--cpu C]
 *
 *   --flags HEX   TUNSETIFF flags (default 0x1001 = IFF_TUN|IFF_NO_PI); add
 *                 0x0080 for IFF_BACKPRESSURE where the kernel reports it
 *   --delay-us N  sleep N us after each packet read from the tun: a slow
 *                 reader (scheduling delay)
 *   --spin-us N   busy-wait N us after each packet read from the tun: a
 *                 CPU-bound reader (emulates per-packet encryption)
 *   --rate-pps N  read at most N packets per second from the tun (token
 *                 bucket of --burst packets, default max(4, N/50), i.e.
 *                 20 ms worth: under TCG a timer wake-up can be late by
 *                 several ms, and a smaller bucket then loses tokens and
 *                 the rate). The reader sleeps in ppoll() between tokens,
 *                 so it costs no CPU and keeps serving the UDP socket (the
 *                 reverse direction) while the tun is throttled: a slow
 *                 uplink behind the VPN, with the standing queue at the tun.
 *
 * Every packet read from the tun is sent as one UDP datagram to the peer;
 * every UDP datagram received is written into the tun. One thread, ppoll();
 * at most BATCH packets of one direction per turn (and, with --rate-pps, at
 * most the tokens available).
 * Two of these in two network namespaces joined by a veth pair are the
 * "VPN" path of the benchmarks.
 *
 * Prints {"event":"ready",...} once the device exists, and the counters as a
 * JSON line on SIGTERM/SIGINT (then exits) or SIGUSR1 (keeps running).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define BATCH 64
#define BUFSZ 65536

static volatile sig_atomic_t stop_req, stat_req;
static unsigned long long tun_rx, udp_tx, udp_tx_err, udp_rx, tun_tx, tun_tx_err;

static void on_sig(int sig)
{
	if (sig == SIGUSR1)
		stat_req = 1;
	else
		stop_req = 1;
}

static void print_counters(const char *event)
{
	printf("{\"event\":\"%s\",\"tun_rx\":%llu,\"udp_tx\":%llu,"
	       "\"udp_tx_err\":%llu,\"udp_rx\":%llu,\"tun_tx\":%llu,"
	       "\"tun_tx_err\":%llu}\n", event, tun_rx, udp_tx, udp_tx_err,
	       udp_rx, tun_tx, tun_tx_err);
	fflush(stdout);
}

static int parse_addr(const char *s, struct sockaddr_in *sa)
{
	char host[64];
	const char *colon = strrchr(s, ':');
	size_t n;

	if (!colon)
		return -1;
	n = (size_t)(colon - s);
	if (n >= sizeof(host))
		return -1;
	memcpy(host, s, n);
	host[n] = 0;
	memset(sa, 0, sizeof(*sa));
	sa->sin_family = AF_INET;
	sa->sin_port = htons((uint16_t)atoi(colon + 1));
	return inet_pton(AF_INET, host, &sa->sin_addr) == 1 ? 0 : -1;
}

static uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void slow_down(long delay_us, long spin_us)
{
	if (delay_us > 0) {
		struct timespec ts = { delay_us / 1000000, (delay_us % 1000000) * 1000 };

		nanosleep(&ts, NULL);
	}
	if (spin_us > 0) {
		uint64_t end = now_ns() + (uint64_t)spin_us * 1000ull;

		while (now_ns() < end)
			;
	}
}

static void usage(void)
{
	fprintf(stderr,
		"usage: tunnel --dev NAME [--flags HEX] --local IP:PORT --peer IP:PORT\n"
		"              [--delay-us N] [--spin-us N] [--rate-pps N [--burst N]]\n"
		"              [--sndbuf B] [--cpu C]\n");
	exit(2);
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "dev", required_argument, NULL, 'd' },
		{ "flags", required_argument, NULL, 'f' },
		{ "local", required_argument, NULL, 'l' },
		{ "peer", required_argument, NULL, 'p' },
		{ "delay-us", required_argument, NULL, 'D' },
		{ "spin-us", required_argument, NULL, 'S' },
		{ "rate-pps", required_argument, NULL, 'r' },
		{ "burst", required_argument, NULL, 'B' },
		{ "sndbuf", required_argument, NULL, 'b' },
		{ "cpu", required_argument, NULL, 'c' },
		{ NULL, 0, NULL, 0 },
	};
	const char *dev = NULL, *local = NULL, *peer = NULL;
	unsigned int flags = IFF_TUN | IFF_NO_PI;
	long delay_us = 0, spin_us = 0, rate_pps = 0, burst = 0;
	double tokens = 0;
	uint64_t last_ns = 0;
	int sndbuf = 4 << 20, cpu = -1, c, tfd, ufd;
	struct sockaddr_in la, pa;
	struct ifreq ifr;
	struct sigaction sa;
	static unsigned char buf[BUFSZ];

	while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (c) {
		case 'd': dev = optarg; break;
		case 'f': flags = (unsigned int)strtoul(optarg, NULL, 0); break;
		case 'l': local = optarg; break;
		case 'p': peer = optarg; break;
		case 'D': delay_us = atol(optarg); break;
		case 'S': spin_us = atol(optarg); break;
		case 'r': rate_pps = atol(optarg); break;
		case 'B': burst = atol(optarg); break;
		case 'b': sndbuf = atoi(optarg); break;
		case 'c': cpu = atoi(optarg); break;
		default: usage();
		}
	}
	if (!dev || !local || !peer || strlen(dev) >= IFNAMSIZ || rate_pps < 0)
		usage();
	if (rate_pps && burst <= 0)
		burst = rate_pps / 50 > 4 ? rate_pps / 50 : 4;
	if (parse_addr(local, &la) || parse_addr(peer, &pa)) {
		fprintf(stderr, "tunnel: bad address\n");
		return 2;
	}
	if (cpu >= 0) {
		cpu_set_t set;

		CPU_ZERO(&set);
		CPU_SET(cpu, &set);
		if (sched_setaffinity(0, sizeof(set), &set))
			perror("tunnel: sched_setaffinity");
	}

	tfd = open("/dev/net/tun", O_RDWR | O_NONBLOCK);
	if (tfd < 0) {
		perror("tunnel: /dev/net/tun");
		return 1;
	}
	memset(&ifr, 0, sizeof(ifr));
	strncpy(ifr.ifr_name, dev, IFNAMSIZ - 1);
	ifr.ifr_flags = (short)flags;
	if (ioctl(tfd, TUNSETIFF, &ifr)) {
		perror("tunnel: TUNSETIFF");
		return 1;
	}
	memset(&ifr, 0, sizeof(ifr));
	if (ioctl(tfd, TUNGETIFF, &ifr)) {
		perror("tunnel: TUNGETIFF");
		return 1;
	}

	ufd = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK, 0);
	if (ufd < 0) {
		perror("tunnel: socket");
		return 1;
	}
	if (setsockopt(ufd, SOL_SOCKET, SO_SNDBUFFORCE, &sndbuf, sizeof(sndbuf)))
		setsockopt(ufd, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof(sndbuf));
	if (setsockopt(ufd, SOL_SOCKET, SO_RCVBUFFORCE, &sndbuf, sizeof(sndbuf)))
		setsockopt(ufd, SOL_SOCKET, SO_RCVBUF, &sndbuf, sizeof(sndbuf));
	if (bind(ufd, (struct sockaddr *)&la, sizeof(la))) {
		perror("tunnel: bind");
		return 1;
	}
	if (connect(ufd, (struct sockaddr *)&pa, sizeof(pa))) {
		perror("tunnel: connect");
		return 1;
	}

	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_sig;
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);
	sigaction(SIGUSR1, &sa, NULL);

	printf("{\"event\":\"ready\",\"dev\":\"%s\",\"iff\":%u}\n", ifr.ifr_name,
	       (unsigned int)(unsigned short)ifr.ifr_flags);
	fflush(stdout);

	last_ns = now_ns();
	while (!stop_req) {
		struct pollfd pfd[2] = {
			{ .fd = tfd, .events = POLLIN },
			{ .fd = ufd, .events = POLLIN },
		};
		struct timespec to = { 0, 200 * 1000000L };
		long allowed = BATCH;
		int i, n;

		if (stat_req) {
			stat_req = 0;
			print_counters("stat");
		}
		if (rate_pps) {
			uint64_t t = now_ns();

			tokens += (double)(t - last_ns) * (double)rate_pps / 1e9;
			if (tokens > (double)burst)
				tokens = (double)burst;
			last_ns = t;
			allowed = (long)tokens;
			if (allowed > BATCH)
				allowed = BATCH;
			if (allowed < 1) {
				/* no token: ignore the tun, wake when one is due */
				uint64_t wait = (uint64_t)((1.0 - tokens) * 1e9 / (double)rate_pps) + 1;

				pfd[0].fd = -1;
				to.tv_sec = (time_t)(wait / 1000000000ull);
				to.tv_nsec = (long)(wait % 1000000000ull);
			}
		}
		n = ppoll(pfd, 2, &to, NULL);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			perror("tunnel: ppoll");
			return 1;
		}
		if (pfd[0].revents & POLLIN) {
			for (i = 0; i < allowed && !stop_req; i++) {
				ssize_t r = read(tfd, buf, sizeof(buf));

				if (r < 0)
					break;
				tun_rx++;
				if (rate_pps)
					tokens -= 1.0;
				slow_down(delay_us, spin_us);
				for (;;) {
					if (send(ufd, buf, (size_t)r, 0) == r) {
						udp_tx++;
						break;
					}
					if (errno == EAGAIN || errno == ENOBUFS) {
						struct pollfd w = { .fd = ufd, .events = POLLOUT };

						poll(&w, 1, 10);
						if (stop_req)
							break;
						continue;
					}
					udp_tx_err++;
					break;
				}
			}
		}
		if (pfd[1].revents & POLLIN) {
			for (i = 0; i < BATCH; i++) {
				ssize_t r = recv(ufd, buf, sizeof(buf), 0);

				if (r < 0)
					break;
				udp_rx++;
				if (write(tfd, buf, (size_t)r) == r)
					tun_tx++;
				else
					tun_tx_err++;
			}
		}
	}
	print_counters("exit");
	return 0;
}
