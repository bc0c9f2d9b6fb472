;;;; websockets.lisp -- native WebSockets under the two loads of issue 63's
;;;; first and fifth cases: rounds of 50 WebSockets whose messages the
;;;; server refuses (1009, 1013), which must leave the heap where it was;
;;;; and 300 silent WebSockets against a server limited to 256 fds, which
;;;; the default idle timeout closes so that a fresh client is served.

(in-package #:gallop-tests)

(in-suite stress)

(defun refused-fragments (port)
  "A WebSocket on PORT whose client begins a text message and sends 64 KiB
fragments until the server answers: the octets of the 101 it read, the
octets of the frame that came back, and whether the end of the connection
followed.  Touches no test state: it runs in a thread of its own."
  (let* ((socket (connect port :timeout 30))
         (stream (usocket:socket-stream socket)))
    (unwind-protect
         (handler-case
             (progn
               (ws-send socket (octets (ws-handshake "/echo")))
               (let ((head (read-octets socket (length (exact-101)) :timeout 30)))
                 ;; Past 16 MiB, the limit, a server that has not answered never will.
                 (loop repeat 300
                       for frame = *text-begun* then *continued*
                       until (listen stream)
                       do (ws-send socket frame))
                 (let* ((start (read-octets socket 2 :timeout 30))
                        (payload (and (= 2 (length start))
                                      (read-octets socket (logand 127 (aref start 1))))))
                   (list head (concat-octets start (or payload #()))
                         (closed-by-peer-p socket :timeout 10)))))
           (error (e) (list :error (princ-to-string e))))
      (usocket:socket-close socket))))

(test refused-websocket-fragments-leave-the-heap-where-it-was
  "Ten rounds of 50 WebSockets each sending a text message in 64 KiB
fragments until the server closes it with 1009 (past 16 MiB) or 1013 (the
body budget spent): every client reads one of those close frames exactly,
then the end; nothing stays counted, the heap after a full collection ends
within 32 MiB of where it began, and a fresh WebSocket is served exactly."
  (raise-test-fd-limit)
  (let ((closes (list (server-frame 8 (ws-close-payload 1009 "message too big"))
                      (server-frame 8 (ws-close-payload 1013 "no memory for more messages now")))))
    (with-ends-server (server (ends-app :max-message-bytes (* 16 1024 1024)) '())
      (let* ((port (native-port server))
             (engine (gallop::server-engine server))
             (start (progn (check-fresh-websocket port) (heap-octets))))
        (dotimes (round 10)
          (sb-thread:with-mutex (*ends-lock*) (setf *ends-open* '() *ends-closes* '()))
          (let* ((threads (loop repeat 50
                                collect (sb-thread:make-thread (lambda () (refused-fragments port))
                                                               :name "refused fragments")))
                 (results (mapcar #'sb-thread:join-thread threads)))
            (is (every (lambda (r) (equalp (first r) (exact-101))) results)
                "round ~D: a 101 was not exact: ~S" round
                (find-if-not (lambda (r) (equalp (first r) (exact-101))) results))
            (is (every (lambda (r) (and (member (second r) closes :test #'equalp) (third r)))
                       results)
                "round ~D: not a 1009 or 1013 close, then the end: ~S" round
                (find-if-not (lambda (r) (and (member (second r) closes :test #'equalp) (third r)))
                             results))
            (is (wait-until (lambda () (engine-settled-p engine)))
                "round ~D: still counted: ~D octets, ~D WebSockets" round
                (getf (gallop.core:engine-stats engine) :body-bytes)
                (getf (gallop.core:engine-stats engine) :upgraded))
            (format t "~&    round ~D: heap ~,1F MiB (began at ~,1F)~%" round
                    (/ (heap-octets) 1048576.0) (/ start 1048576.0))))
        (let ((grown (- (heap-octets) start)))
          (is (< grown (* 32 1024 1024)) "the heap grew by ~,1F MiB" (/ grown 1048576.0)))
        (check-fresh-websocket port)))))

(defun start-ws-echo-child (fd-limit)
  "tests/child/ws-echo-server.lisp in a process whose fd limit is FD-LIMIT:
the process and its port."
  (let* ((process (sb-ext:run-program
                   "prlimit" (list (format nil "--nofile=~D:~D" fd-limit fd-limit)
                                   "scripts/lisp.sh" "--load" "tests/child/ws-echo-server.lisp")
                   :search t :wait nil :input :stream :output :stream :error nil
                   :directory (asdf:system-source-directory "gallop")))
         (line (read-line (sb-ext:process-output process) nil "")))
    (values process (and (string= "READY " line :end2 (min 6 (length line)))
                         (parse-integer line :start 6)))))

(test silent-websockets-at-an-fd-limit-keep-no-client-out
  "300 WebSockets that send nothing after their handshake, against a
server limited to 256 fds: it cannot accept them all, and a fresh client
waits behind them; the default idle timeout (60 s) closes the silent ones,
and the fresh client is served then, exactly."
  (raise-test-fd-limit)
  (multiple-value-bind (process port) (start-ws-echo-child 256)
    (let ((sockets '())
          (idle-timeout (eval (gallop.core:setting-default upgraded-idle-timeout))))
      (unwind-protect
           (progn
             (is (numberp port) "the child server did not start")
             (dotimes (i 300)
               (let ((s (connect port :timeout 30)))
                 (push s sockets)
                 (ws-send s (octets (ws-handshake "/echo")))))
             (sleep 1)
             (let ((open (getf (limited-server-stats process) :open)))
               (is (and open (< open 300)) "the server holds ~A connections" open))
             (let ((fresh (connect port :timeout 30))
                   (start (get-internal-real-time)))
               (unwind-protect
                    (progn
                      (ws-send fresh (octets (ws-handshake "/echo")))
                      (is (equalp (exact-101)
                                  (read-octets fresh (length (exact-101))
                                               :timeout (+ idle-timeout 60)))
                          "no 101 for the fresh client")
                      (let ((waited (/ (- (get-internal-real-time) start)
                                       internal-time-units-per-second)))
                        (format t "~&    fresh client: 101 after ~,1F s (idle timeout ~D s)~%"
                                waited idle-timeout)
                        (is (< waited (+ idle-timeout 30)) "waited ~,1F s" waited))
                      (ws-send fresh (ws-frame 1 (octets "served")))
                      (expect-octets fresh (server-frame 1 (octets "served")) "the fresh echo"))
                 (usocket:socket-close fresh)))
             (is (sb-ext:process-alive-p process)))
        (mapc #'usocket:socket-close sockets)
        (stop-limited-server process)))))
