;;;; overload.lisp -- the memory account (src/core/account.lisp) and the
;;;; overload manager (src/core/loop/overload.lisp, shed.lisp): the account's
;;;; arithmetic on its own, then each of the manager's actions on a real
;;;; server, its level set by a small limit and octets charged by the test
;;;; itself, so that what the clients hold decides whom it acts on.
;;;;
;;;; Internals of GALLOP.CORE reached on purpose: the account's own
;;;; arithmetic (ACCOUNT-ADD, ACCOUNT-CHARGE, HEAP-USED, LEVEL-OF and its
;;;; thresholds), the manager's counts and its shedding of one connection
;;;; (OVERLOAD-COUNTS, SHED-CONNECTION), and WRITE-METRICS with a made-up
;;;; account: the account and the manager are the things tested, and no front
;;;; end drives them.

(in-package #:gallop-tests)

(in-suite native)

(test the-account-counts-kinds-and-refuses-past-its-limit
  (with-memory-limit ((* 1024 1024))
    (let ((before (gallop.core::heap-used))
          (messages (memory-used :messages)))
      (is (gallop.core::account-charge :output 1000))
      (is (gallop.core::account-charge :messages 2000))
      (is (= (+ before 3000) (gallop.core::heap-used)))
      (is (= (+ messages 2000) (memory-used :messages)))
      ;; Past the limit nothing is counted.  (Stacks have a limit of their own.)
      (let ((used (gallop.core::heap-used)))
        (is (not (gallop.core::account-charge :bodies (- (* 1024 1024) used -1))))
        (is (= used (gallop.core::heap-used))))
      ;; Up to it, it is.
      (let ((room (- (* 1024 1024) (gallop.core::heap-used))))
        (is (gallop.core::account-charge :bodies room))
        (gallop.core::account-add :bodies (- room)))
      (gallop.core::account-add :output -1000)
      (gallop.core::account-add :messages -2000)
      (is (= before (gallop.core::heap-used))))))

(test stacks-count-under-their-own-limit-and-set-no-level
  (with-memory-limit ((* 1024 1024) :stacks (* 10 1024 1024))
    (let ((stacks (memory-used :stacks))
          (room (- (* 10 1024 1024) (memory-used :stacks))))
      (is (gallop.core::account-charge :stacks (- room 100)))
      (is (not (gallop.core::account-charge :stacks 200)))
      ;; The heap's kinds are not crowded out, and the level is the heap's.
      (is (gallop.core::account-charge :output 1000))
      (is (= 0 (overload-level-now)))
      (gallop.core::account-add :output -1000)
      (gallop.core::account-add :stacks (- 100 room))
      (is (= stacks (memory-used :stacks))))))

(test the-overload-level-follows-the-account-s-thresholds
  (is (equalp #(0 0 1 1 2 2 3 3)
              (map 'vector (lambda (percent)
                             (gallop.core::level-of percent 100 gallop.core::+account-thresholds+))
                   '(0 49 50 69 70 84 85 100))))
  (with-memory-limit ((* 8 1024 1024))
    (with-charged (51) (is (= 1 (overload-level-now))))
    (with-charged (71) (is (= 2 (overload-level-now))))
    (with-charged (86) (is (= 3 (overload-level-now))))
    (is (= 0 (overload-level-now)))))

(test the-metrics-show-the-account-by-kind
  (let ((text (with-output-to-string (out)
                (gallop.core::write-metrics
                 out (list :memory '(:heads 1 :bodies 2 :messages 3 :inflate 4 :output 5 :stacks 6)
                           :memory-limit 100 :overload-level 2
                           :overload-paused 7 :overload-refused 8 :overload-shed 9)
                 (make-array gallop.core::+counts-end+ :initial-element 0)))))
    (dolist (line '("gallop_memory_bytes{kind=\"heads\"} 1" "gallop_memory_bytes{kind=\"bodies\"} 2"
                    "gallop_memory_bytes{kind=\"messages\"} 3" "gallop_memory_bytes{kind=\"inflate\"} 4"
                    "gallop_memory_bytes{kind=\"output\"} 5" "gallop_memory_bytes{kind=\"stacks\"} 6"
                    "gallop_memory_limit_bytes 100" "gallop_overload_level 2"
                    "gallop_overload_actions_total{action=\"paused\"} 7"
                    "gallop_overload_actions_total{action=\"refused\"} 8"
                    "gallop_overload_actions_total{action=\"shed\"} 9"))
      (is (search (format nil "~%~A~%" line) text) "no line ~S" line))))

(defparameter *response-503*
  (let ((crlf (coerce '(#\Return #\Linefeed) 'string)))
    (octets (concatenate 'string "HTTP/1.1 503 Service Unavailable" crlf
                         "Content-Type: text/plain; charset=utf-8" crlf
                         "Content-Length: 24" crlf "Connection: close" crlf
                         "Retry-After: 1" crlf crlf
                         "503 Service Unavailable" (string #\Newline))))
  "The engine's 503, exactly.")

(test level-2-refuses-large-bodies-and-upgrades-and-serves-small-requests
  (with-memory-limit ((* 8 1024 1024))
    (with-native-ws (port)
      (let ((refused (nth-value 1 (gallop.core::overload-counts))))
        (with-charged (71)
          (is (= 2 (overload-level-now)))
          ;; A body larger than BODY-BUFFER-BYTES: 503 before any of it is read.
          (let ((socket (connect port)))
            (unwind-protect
                 (progn
                   (send socket (crlf "POST /x HTTP/1.1" "Host: x" "Content-Length: 1000000" "" ""))
                   (expect-octets socket *response-503* "the 503")
                   (is (closed-by-peer-p socket)))
              (usocket:socket-close socket)))
          ;; A small request is served.
          (let ((response (request port (crlf "GET / HTTP/1.1" "Host: x" "" ""))))
            (is (and response (= 200 (response-status response))
                     (equal "plain" (body-string response)))))
          ;; A small body too.
          (let ((response (request port (crlf "POST / HTTP/1.1" "Host: x" "Content-Length: 5"
                                              "" "hello"))))
            (is (and response (= 200 (response-status response)))))
          ;; A WebSocket: 503 with Retry-After instead of its 101.
          (let ((response (request port (ws-handshake "/echo"))))
            (is (and response (= 503 (response-status response))))
            (when response
              (is (equal "1" (header response "Retry-After")))
              (is (equal (format nil "503 Service Unavailable~%") (body-string response)))))
          (is (= (+ refused 2) (nth-value 1 (gallop.core::overload-counts))))
          (is (= 2 (getf (gallop:stats *ws-server*) :overload-level))))
        ;; Memory back: the same WebSocket is accepted.
        (with-native-socket (s port))))))

(defun ws-partial-message (socket octets)
  "Send the first frame of a text message of OCTETS (not final)."
  (ws-send socket (ws-frame 1 octets :fin nil)))

(test level-1-stops-reading-the-largest-holder-until-memory-is-back
  (with-memory-limit ((* 8 1024 1024))
    (with-native-ws (port)
      (with-native-socket (s port)
        (let ((paused (gallop.core::overload-counts))
              (first (make-array (* 200 1024) :element-type '(unsigned-byte 8)
                                              :initial-element (char-code #\a))))
          (with-charged (51)
            (is (= 1 (overload-level-now)))
            (ws-partial-message s first)
            (ws-send s (ws-frame 0 (octets "bcd")))
            ;; It holds 64 KiB or more of its message: not read further.
            (is (wait-until (lambda () (> (gallop.core::overload-counts) paused))))
            (sleep 0.3)
            (is (> (* 200 1024) (memory-used :messages)))
            (is (null *ws-closes*)))
          ;; Back to level 0: read again, and the message arrives whole.
          (expect-octets s (server-frame 1 (concatenate 'octets-vector first (octets "bcd")))
                         "the echo"))))))

(test level-3-closes-the-largest-holder-first-with-1013
  (with-memory-limit ((* 8 1024 1024))
    (with-native-ws (port)
      (with-native-socket (big port)
        (with-native-socket (small port)
          (let ((shed (nth-value 2 (gallop.core::overload-counts))))
            (ws-partial-message big (make-array (* 1536 1024) :element-type '(unsigned-byte 8)
                                                              :initial-element 97))
            (ws-partial-message small (make-array (* 40 1024) :element-type '(unsigned-byte 8)
                                                             :initial-element 98))
            (is (wait-until (lambda () (>= (memory-used :messages)
                                           (+ (* 1536 1024) (* 40 1024))))))
            (with-charged (86)
              ;; The largest is closed, with 1013 (try again later) ...
              (let ((payload (octets "  server short of memory")))
                (setf (aref payload 0) 3 (aref payload 1) 245) ; 1013
                (expect-octets big (server-frame 8 payload) "the close frame"))
              (is (closed-by-peer-p big))
              (is (wait-until (lambda () (= (1+ shed) (nth-value 2 (gallop.core::overload-counts))))))
              ;; ON-CLOSE runs on a worker once the connection ended.
              (is (wait-until (lambda () *ws-closes*)))
              (is (equal '((1013 "server short of memory")) *ws-closes*)))
            ;; ... and it was enough: the other finishes its message.
            (ws-send small (ws-frame 0 (octets "!")))
            (expect-octets small (server-frame 1 (concatenate 'octets-vector
                                                              (make-array (* 40 1024) :initial-element 98)
                                                              (octets "!")))
                           "the small one's echo")
            (is (= (1+ shed) (nth-value 2 (gallop.core::overload-counts))))))))))

(test level-3-resets-an-answer-waiting-for-its-reader-and-serves-small-requests
  "A client that reads nothing of a 4 MiB answer holds it in the output
queue: at level 3 it is the largest holder, and its connection is reset,
while a small request is served."
  (with-memory-limit ((* 16 1024 1024))
    (with-app (server #'slow-app)
      (let ((port (native-port server))
            (shed (nth-value 2 (gallop.core::overload-counts))))
        (with-slow-readers (readers)
          (let ((reader (slow-reader port)))
            (push reader readers)
            (slow-reader-send reader (get-line "/big"))
            (is (wait-until (lambda () (> (memory-used :output) (* 3 1024 1024)))))
            (with-charged (86)
              (is (wait-until (lambda () (= (1+ shed) (nth-value 2 (gallop.core::overload-counts))))))
              (is (wait-until (lambda () (zerop (stat server :unsent-bytes)))))
              ;; The client reads what the kernel had, then the reset.
              (is (eq :reset
                      (handler-case (let ((stream (slow-reader-stream reader))
                                          (buffer (make-array 65536 :element-type '(unsigned-byte 8))))
                                      (loop while (plusp (read-sequence buffer stream)))
                                      :eof)
                        (error () :reset))))
              (let ((response (request port (crlf "GET /yo HTTP/1.1" "Host: x" "" ""))))
                (is (and response (equal "Yo!" (body-string response))))))))))))

(test level-3-answers-503-to-a-body-still-arriving
  "A body arriving at level 0 is held in memory; at level 3 its connection
holds among the most, and gets the engine's 503, exactly, then the close."
  (with-memory-limit ((* 8 1024 1024))
    (with-native-ws (port)
      (let ((socket (connect port)))
        (unwind-protect
             (progn
               (send socket (format nil "~A~A"
                                    (crlf "POST /x HTTP/1.1" "Host: x" "Content-Length: 60000")
                                    (make-string 40000 :initial-element #\a)))
               (is (wait-until (lambda () (>= (memory-used :bodies) 40000))))
               (with-charged (86)
                 (expect-octets socket *response-503* "the 503")
                 (is (closed-by-peer-p socket))))
          (usocket:socket-close socket))
        (is (wait-until (lambda () (zerop (memory-used :bodies)))))))))

(test a-mark-of-the-overload-manager-is-for-one-request
  "The manager marks a connection a worker owns (its next queued write
fails); once that request is answered and the connection parks, the mark
is gone: a later answer on the same keep-alive connection, too big for the
socket, is not reset."
  (let ((big (make-array (* 4 1024 1024) :element-type '(unsigned-byte 8) :initial-element 7)))
    (flet ((app (env)
             (if (string= "/mark" (getf env :path-info))
                 (progn (gallop.core::shed-connection
                         (gallop::exchange-connection (getf env :clack.io)))
                        '(200 (:content-type "text/plain") ("marked")))
                 `(200 (:content-type "application/octet-stream") ,big))))
      (with-app (server #'app)
        (with-slow-readers (readers)
          (let ((socket (slow-reader (native-port server))))
            (push socket readers)
            (slow-reader-send socket (get-line "/mark"))
            (let ((source (stream-source (slow-reader-stream socket))))
              (expect-answer source (octets "marked"))
              (slow-reader-send socket (get-line "/big"))
              (is (wait-until (lambda () (plusp (stat server :unsent-bytes)))))
              (expect-answer source big))))))))
