;;;; websocket-corpus.lisp -- RFC 6455, section by section, as cases an echo
;;;; server is sent after its handshake (the shapes of the Autobahn
;;;; testsuite's cases 1-7 and 9): framing, pings, reserved bits, opcodes,
;;;; fragmentation, UTF-8, the close handshake, sizes.  Each case is what the
;;;; client sends and what RFC 6455 says an echo server answers: frames,
;;;; exactly, then, for a case that ends the WebSocket, a close frame with a
;;;; given code (its reason free) and the end of the connection.
;;;;
;;;; websocket-runner.lisp sends each case whole and one octet at a time to
;;;; the native API, websocket-driver on Clack :gallop and hunchensocket on
;;;; Gallop, and doc/websocket-conformance.md says where the libraries differ.

(in-package #:gallop-tests)

(defun text-octets (string) (sb-ext:string-to-octets string :external-format :utf-8))

(defun filled (n &optional (octet 42))
  (make-array n :element-type '(unsigned-byte 8) :initial-element octet))

(defun frames (&rest frames) (apply #'concat-octets frames))

(defmacro define-ws-corpus (name &body cases)
  "NAME: a list of (ID SECTION DESCRIPTION CLIENT-OCTETS EXPECTED), EXPECTED a
list of (:FRAME OPCODE PAYLOAD) and, last, (:CLOSE CODE) (a close frame with
CODE, then the end of the connection), (:END) (the end of the connection)
or nothing (the WebSocket stays open).  A case (:ECHOED CODES) or (:REFUSED
CODES) stands for one close case per code: echoed, or refused with 1002."
  `(defparameter ,name
     (append
      ,@(loop for case in cases
              collect (if (stringp (first case))
                          (destructuring-bind (id section description client expected) case
                            `(list (list ,id ,section ,description ,client ,expected)))
                          (destructuring-bind (kind codes) case
                            (let ((echoed (eq kind :echoed)))
                              `(loop for code in ',codes
                                     collect (list (format nil ,(if echoed "7.7.~D" "7.9.~D") code)
                                                   "7.4"
                                                   (format nil ,(if echoed
                                                                    "close code ~D is echoed"
                                                                    "close code ~D is refused")
                                                           code)
                                                   (ws-frame 8 (ws-close-payload code))
                                                   (list (list :close ,(if echoed 'code 1002))))))))))))

(define-ws-corpus *ws-corpus*
  ;; 5.2, 5.6: data frames at each length form (Autobahn 1.1, 1.2)
  ("1.1.1" "5.6" "text, empty" (ws-frame 1 #()) '((:frame 1 #())))
  ("1.1.2" "5.2" "text, 125 octets" (ws-frame 1 (filled 125)) `((:frame 1 ,(filled 125))))
  ("1.1.3" "5.2" "text, 126 octets (16-bit length)" (ws-frame 1 (filled 126)) `((:frame 1 ,(filled 126))))
  ("1.1.4" "5.2" "text, 127 octets" (ws-frame 1 (filled 127)) `((:frame 1 ,(filled 127))))
  ("1.1.5" "5.2" "text, 65535 octets" (ws-frame 1 (filled 65535)) `((:frame 1 ,(filled 65535))))
  ("1.1.6" "5.2" "text, 65536 octets (64-bit length)" (ws-frame 1 (filled 65536)) `((:frame 1 ,(filled 65536))))
  ("1.2.1" "5.6" "binary, empty" (ws-frame 2 #()) '((:frame 2 #())))
  ("1.2.2" "5.2" "binary, 125 octets" (ws-frame 2 (filled 125 255)) `((:frame 2 ,(filled 125 255))))
  ("1.2.3" "5.2" "binary, 126 octets" (ws-frame 2 (filled 126 0)) `((:frame 2 ,(filled 126 0))))
  ("1.2.4" "5.2" "binary, 65536 octets" (ws-frame 2 (filled 65536 7)) `((:frame 2 ,(filled 65536 7))))
  ("1.2.5" "5.2" "two messages in one write" (frames (ws-frame 1 (text-octets "a")) (ws-frame 2 #(1)))
   '((:frame 1 #(97)) (:frame 2 #(1))))
  ;; 5.5.2, 5.5.3: pings and pongs (Autobahn 2)
  ("2.1" "5.5.2" "ping, empty" (ws-frame 9 #()) '((:frame 10 #())))
  ("2.2" "5.5.2" "ping with text" (ws-frame 9 (text-octets "Hello")) `((:frame 10 ,(text-octets "Hello"))))
  ("2.3" "5.5.2" "ping with binary" (ws-frame 9 #(0 255 254 253)) '((:frame 10 #(0 255 254 253))))
  ("2.4" "5.5.2" "ping, 125 octets" (ws-frame 9 (filled 125)) `((:frame 10 ,(filled 125))))
  ("2.5" "5.5" "ping, 126 octets" (ws-frame 9 (filled 126)) '((:close 1002)))
  ("2.6" "5.5.3" "unsolicited pong, then a ping" (frames (ws-frame 10 (text-octets "x")) (ws-frame 9 #(1)))
   '((:frame 10 #(1))))
  ("2.7" "5.5.2" "ten pings" (apply #'frames (loop for i below 10 collect (ws-frame 9 (vector i))))
   (loop for i below 10 collect `(:frame 10 ,(vector i))))
  ;; 5.2: reserved bits (Autobahn 3)
  ("3.1" "5.2" "RSV1 on a text" (let ((f (ws-frame 1 (text-octets "a")))) (setf (aref f 0) #xC1) f) '((:close 1002)))
  ("3.2" "5.2" "RSV2, after a good message" (frames (ws-frame 1 (text-octets "ok"))
                                                     (let ((f (ws-frame 1 (text-octets "a")))) (setf (aref f 0) #xA1) f))
   `((:frame 1 ,(text-octets "ok")) (:close 1002)))
  ("3.3" "5.2" "RSV3 on a ping" (let ((f (ws-frame 9 #()))) (setf (aref f 0) #x99) f) '((:close 1002)))
  ;; 5.2: opcodes (Autobahn 4)
  ("4.1.1" "5.2" "data opcode 3" (ws-frame 3 #()) '((:close 1002)))
  ("4.1.2" "5.2" "data opcode 7, after a good message" (frames (ws-frame 1 (text-octets "ok")) (ws-frame 7 #(1)))
   `((:frame 1 ,(text-octets "ok")) (:close 1002)))
  ("4.2.1" "5.2" "control opcode 11" (ws-frame 11 #()) '((:close 1002)))
  ("4.2.2" "5.2" "control opcode 15" (ws-frame 15 #(1)) '((:close 1002)))
  ;; 5.4: fragmentation (Autobahn 5)
  ("5.1" "5.4" "a fragmented ping" (ws-frame 9 #(1) :fin nil) '((:close 1002)))
  ("5.2" "5.4" "a fragmented pong" (ws-frame 10 #(1) :fin nil) '((:close 1002)))
  ("5.3" "5.4" "text in two fragments"
   (frames (ws-frame 1 (text-octets "frag") :fin nil) (ws-frame 0 (text-octets "ment")))
   `((:frame 1 ,(text-octets "fragment"))))
  ("5.4" "5.4" "text in three fragments, a ping between"
   (frames (ws-frame 1 (text-octets "a") :fin nil) (ws-frame 9 (text-octets "p"))
           (ws-frame 0 (text-octets "b") :fin nil) (ws-frame 0 (text-octets "c")))
   `((:frame 10 ,(text-octets "p")) (:frame 1 ,(text-octets "abc"))))
  ("5.5" "5.4" "binary in fragments, empty ones among them"
   (frames (ws-frame 2 #() :fin nil) (ws-frame 0 #(1 2) :fin nil) (ws-frame 0 #() :fin nil) (ws-frame 0 #(3)))
   '((:frame 2 #(1 2 3))))
  ("5.6" "5.4" "a continuation with nothing to continue" (ws-frame 0 (text-octets "a")) '((:close 1002)))
  ("5.7" "5.4" "a text where a continuation was due"
   (frames (ws-frame 1 (text-octets "a") :fin nil) (ws-frame 1 (text-octets "b"))) '((:close 1002)))
  ("5.8" "5.4" "a final continuation alone, then a text"
   (frames (ws-frame 0 (text-octets "a")) (ws-frame 1 (text-octets "b"))) '((:close 1002)))
  ;; 8.1: UTF-8 (Autobahn 6)
  ("6.1" "8.1" "valid UTF-8 of one to four octets" (ws-frame 1 (text-octets "aé€𝄞"))
   `((:frame 1 ,(text-octets "aé€𝄞"))))
  ("6.2" "8.1" "valid UTF-8 split inside a character across fragments"
   (frames (ws-frame 1 #(#xF0 #x9D) :fin nil) (ws-frame 0 #(#x84 #x9E)))
   `((:frame 1 ,(text-octets "𝄞"))))
  ("6.3" "8.1" "an overlong encoding" (ws-frame 1 #(#xC0 #xAF)) '((:close 1007)))
  ("6.4" "8.1" "a surrogate" (ws-frame 1 #(#xED #xA0 #x80)) '((:close 1007)))
  ("6.5" "8.1" "past U+10FFFF" (ws-frame 1 #(#xF4 #x90 #x80 #x80)) '((:close 1007)))
  ("6.6" "8.1" "a stray continuation octet" (ws-frame 1 #(#x41 #x80 #x41)) '((:close 1007)))
  ("6.7" "8.1" "a message ending inside a character" (ws-frame 1 #(#x41 #xE2 #x82)) '((:close 1007)))
  ("6.8" "8.1" "invalid in the first fragment, before the rest"
   (frames (ws-frame 1 #(#xCE #xBA #xFF) :fin nil) (ws-frame 0 (text-octets "a"))) '((:close 1007)))
  ("6.9" "8.1" "binary is not UTF-8 checked" (ws-frame 2 #(#xFF #xFE)) '((:frame 2 #(#xFF #xFE))))
  ;; 5.5.1, 7.4: the close handshake (Autobahn 7)
  ("7.1.1" "5.5.1" "close, no payload" (ws-frame 8 #()) '((:frame 8 #()) (:end)))
  ("7.1.2" "5.5.1" "close 1000 with a reason" (ws-frame 8 (ws-close-payload 1000 "bye"))
   `((:close 1000)))
  ("7.1.3" "5.5.1" "a message after the close is not echoed"
   (frames (ws-frame 8 (ws-close-payload 1000)) (ws-frame 1 (text-octets "late"))) '((:close 1000)))
  ("7.1.4" "5.5.1" "a message, then close" (frames (ws-frame 1 (text-octets "hi")) (ws-frame 8 (ws-close-payload 1000)))
   `((:frame 1 ,(text-octets "hi")) (:close 1000)))
  ("7.3.1" "5.5.1" "a close payload of one octet" (ws-frame 8 #(3)) '((:close 1002)))
  ("7.3.2" "5.5" "a close of 126 octets" (ws-frame 8 (concat-octets (ws-close-payload 1000) (filled 124 97)))
   '((:close 1002)))
  ("7.5.1" "8.1" "a close reason in bad UTF-8" (ws-frame 8 (concat-octets (ws-close-payload 1000) #(#xCE #xBA #xFF)))
   '((:close 1007)))
  (:echoed (1000 1001 1002 1003 1007 1008 1009 1010 1011 3000 3999 4000 4999))
  (:refused (0 999 1004 1005 1006 1016 1100 2000 2999 5000 65535))
  ;; 5.2, 10.4: sizes (Autobahn 9, the shapes that fit a test run)
  ("9.1" "5.2" "binary, 1 MiB" (ws-frame 2 (filled (* 1024 1024) 3)) `((:frame 2 ,(filled (* 1024 1024) 3))))
  ("9.2" "5.4" "text, 1 MiB in 64 fragments"
   (apply #'frames (loop for i below 64 collect (ws-frame (if (zerop i) 1 0) (filled 16384 98) :fin (= i 63))))
   `((:frame 1 ,(filled (* 1024 1024) 98)))))
