// SPDX-License-Identifier: GPL-2.0
/*
 * udpburst - send UDP datagrams as fast as possible (or at a rate).
 *
 * Every datagram carries a 16-byte header that tunreader recognises:
 *   "NDRP" magic, sender id (be32), sequence number (be32), flow (be32).
 *
 * usage: udpburst --dst IP --port P [--src IP] [--sport P] [--flows K]
 *                 [--count N] [--size BYTES] [--id ID] [--cpu C] [--pps R]
 *                 [--sndbuf BYTES] [--wait-stdin]
 *
 *   --count 0   send until SIGTERM/SIGINT
 *   --flows K   use K sockets bound to source ports sport..sport+K-1,
 *               round robin (K different flows, e.g. for multi-queue)
 *   --sndbuf B  SO_SNDBUFFORCE (root) so a paused reader does not block us
 *   --wait-stdin  open sockets, then wait for a line (or EOF) on stdin
 *               before sending (lets several senders start together)
 *
 * Sockets have SO_SNDTIMEO 100 ms, so a send blocked on a full socket
 * buffer returns EAGAIN: the datagram is retried (counted in "eagain_retries",
 * not in "sent") after the stop flag is re-checked, so SIGTERM always
 * ends the program promptly. "sent" counts datagrams handed to the kernel
 * or refused with a hard error; "errors" the latter.
 *
 * Send errors never stop the sender: they are counted by errno.
 * Prints one JSON object on stdout at exit:
 *   {"sent":N,"ok":N,"errors":N,"enobufs":N,"eagain_retries":N,"enetunreach":N,
 *    "eperm":N,"other":N,"last_errno":E,"cpu":C,"id":ID}
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#define MAX_FLOWS 64

static volatile sig_atomic_t stop;

static void on_signal(int sig)
{
	(void)sig;
	stop = 1;
}

static void die(const char *what)
{
	fprintf(stderr, "udpburst: %s: %s\n", what, strerror(errno));
	exit(2);
}

static uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void usage(void)
{
	fprintf(stderr,
		"usage: udpburst --dst IP --port P [--src IP] [--sport P] [--flows K]\n"
		"                [--count N] [--size BYTES] [--id ID] [--cpu C]\n"
		"                [--pps R] [--sndbuf BYTES] [--wait-stdin]\n");
	exit(2);
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "dst", required_argument, NULL, 'd' },
		{ "port", required_argument, NULL, 'p' },
		{ "src", required_argument, NULL, 's' },
		{ "sport", required_argument, NULL, 'S' },
		{ "flows", required_argument, NULL, 'f' },
		{ "count", required_argument, NULL, 'n' },
		{ "size", required_argument, NULL, 'l' },
		{ "id", required_argument, NULL, 'i' },
		{ "cpu", required_argument, NULL, 'c' },
		{ "pps", required_argument, NULL, 'r' },
		{ "sndbuf", required_argument, NULL, 'b' },
		{ "wait-stdin", no_argument, NULL, 'w' },
		{ NULL, 0, NULL, 0 },
	};
	const char *dst = NULL, *src = NULL;
	int port = 0, sport = 0, flows = 1, size = 1000, cpu = -1;
	long long count = 1000, pps = 0;
	unsigned int id = 0;
	int sndbuf = 0, wait_stdin = 0;
	int fds[MAX_FLOWS];
	struct sockaddr_in to;
	struct sigaction sa;
	struct timeval tmo = { 0, 100000 };
	unsigned char *buf;
	unsigned long long sent = 0, ok = 0, enobufs = 0, eagain = 0;
	unsigned long long enetunreach = 0, eperm = 0, other = 0;
	int last_errno = 0;
	uint64_t start, gap_ns = 0;
	int c, k;

	while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (c) {
		case 'd': dst = optarg; break;
		case 'p': port = atoi(optarg); break;
		case 's': src = optarg; break;
		case 'S': sport = atoi(optarg); break;
		case 'f': flows = atoi(optarg); break;
		case 'n': count = atoll(optarg); break;
		case 'l': size = atoi(optarg); break;
		case 'i': id = (unsigned int)strtoul(optarg, NULL, 0); break;
		case 'c': cpu = atoi(optarg); break;
		case 'r': pps = atoll(optarg); break;
		case 'b': sndbuf = atoi(optarg); break;
		case 'w': wait_stdin = 1; break;
		default: usage();
		}
	}
	if (!dst || port <= 0 || flows < 1 || flows > MAX_FLOWS ||
	    size < 16 || size > 65000 || count < 0)
		usage();
	if (flows > 1 && sport <= 0) {
		fprintf(stderr, "udpburst: --flows needs --sport\n");
		exit(2);
	}

	if (cpu >= 0) {
		cpu_set_t set;

		CPU_ZERO(&set);
		CPU_SET(cpu, &set);
		if (sched_setaffinity(0, sizeof(set), &set))
			die("sched_setaffinity");
	}

	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_signal;	/* no SA_RESTART: interrupt sendto */
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);

	memset(&to, 0, sizeof(to));
	to.sin_family = AF_INET;
	to.sin_port = htons((uint16_t)port);
	if (inet_pton(AF_INET, dst, &to.sin_addr) != 1) {
		fprintf(stderr, "udpburst: bad --dst %s\n", dst);
		exit(2);
	}

	for (k = 0; k < flows; k++) {
		fds[k] = socket(AF_INET, SOCK_DGRAM, 0);
		if (fds[k] < 0)
			die("socket");
		if (sndbuf > 0 &&
		    setsockopt(fds[k], SOL_SOCKET, SO_SNDBUFFORCE, &sndbuf,
			       sizeof(sndbuf)) &&
		    setsockopt(fds[k], SOL_SOCKET, SO_SNDBUF, &sndbuf,
			       sizeof(sndbuf)))
			die("SO_SNDBUF");
		/* a blocked send re-checks the stop flag every 100 ms */
		if (setsockopt(fds[k], SOL_SOCKET, SO_SNDTIMEO, &tmo,
			       sizeof(tmo)))
			die("SO_SNDTIMEO");
		if (src || sport > 0) {
			struct sockaddr_in me;

			memset(&me, 0, sizeof(me));
			me.sin_family = AF_INET;
			me.sin_port = htons((uint16_t)(sport > 0 ? sport + k : 0));
			if (src && inet_pton(AF_INET, src, &me.sin_addr) != 1) {
				fprintf(stderr, "udpburst: bad --src %s\n", src);
				exit(2);
			}
			if (bind(fds[k], (struct sockaddr *)&me, sizeof(me)))
				die("bind");
		}
	}

	buf = calloc(1, (size_t)size);
	if (!buf)
		die("calloc");
	memcpy(buf, "NDRP", 4);
	{
		uint32_t v = htonl(id);

		memcpy(buf + 4, &v, 4);
	}

	if (wait_stdin) {
		char line[64];

		if (!fgets(line, sizeof(line), stdin) && ferror(stdin))
			die("stdin");
	}

	if (pps > 0)
		gap_ns = 1000000000ull / (uint64_t)pps;
	start = now_ns();

	while (!stop && (count == 0 || (long long)sent < count)) {
		int fd = fds[sent % (unsigned long long)flows];
		uint32_t seq = htonl((uint32_t)sent);
		uint32_t flow = htonl((uint32_t)(sent % (unsigned long long)flows));
		ssize_t r;

		if (gap_ns) {
			uint64_t due = start + sent * gap_ns;
			uint64_t now = now_ns();

			if (due > now) {
				struct timespec ts = {
					.tv_sec = (time_t)((due - now) / 1000000000ull),
					.tv_nsec = (long)((due - now) % 1000000000ull),
				};
				nanosleep(&ts, NULL);
				continue;	/* re-check stop */
			}
		}
		memcpy(buf + 8, &seq, 4);
		memcpy(buf + 12, &flow, 4);
		r = sendto(fd, buf, (size_t)size, 0, (struct sockaddr *)&to,
			   sizeof(to));
		if (r < 0 && errno == EINTR && stop)
			break;
		if (r < 0 && (errno == EAGAIN || errno == EINTR)) {
			/* not sent (socket buffer full): retry it */
			eagain++;
			continue;
		}
		sent++;
		if (r >= 0) {
			ok++;
			continue;
		}
		last_errno = errno;
		switch (errno) {
		case ENOBUFS: enobufs++; break;
		case ENETUNREACH: enetunreach++; break;
		case EPERM: eperm++; break;
		default: other++; break;
		}
		/* back off a little so an unreachable net does not spin */
		if (errno != ENOBUFS) {
			struct timespec ts = { 0, 200000 };

			nanosleep(&ts, NULL);
		}
	}

	printf("{\"sent\":%llu,\"ok\":%llu,\"errors\":%llu,\"enobufs\":%llu,"
	       "\"eagain_retries\":%llu,\"enetunreach\":%llu,\"eperm\":%llu,"
	       "\"other\":%llu,\"last_errno\":%d,\"cpu\":%d,\"id\":%u}\n",
	       sent, ok, sent - ok, enobufs, eagain, enetunreach, eperm, other,
	       last_errno, cpu, id);
	fflush(stdout);
	for (k = 0; k < flows; k++)
		close(fds[k]);
	free(buf);
	return 0;
}
